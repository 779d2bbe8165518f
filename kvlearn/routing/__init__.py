"""Chapter 7: many engine replicas behind a router, simulated at fleet scale.

trace_request  one request of a trace (TraceRequest) and TraceError: what every trace reader returns
traces         requests over time: a seeded multi-tenant generator, and JSON Lines traces checked line by line
jsonlines      JSON Lines files (gzipped or not) read line by line within bounds, every bad line reported
mooncake       real production traces (Mooncake FAST'25, bundled; AIPerf / LiteLLM): prompt-block ids
replay         `python -m kvlearn replay`: a trace through one radix cache per capacity (Figure 9)
pooled         one prefix pool every replica loads from (Mooncake Store, LMCache; Figure 10)
policies       round_robin, random, least_load, prefix_hash, cache_aware (SGLang's rule), exact
timemodel      seconds per engine step from its work, calibrated on the real model
replicas       a fleet's replicas: chapter 6's scheduler without the model (SimReplica) or a real Engine
fleet          the event loop that routes a trace over the replicas, in simulated time
budget         memory estimated before it is taken: a fleet, its queued requests, trace text, a generated trace
cli            `python -m kvlearn route`
"""
