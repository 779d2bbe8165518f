"""Tool: benchmarks and the demo (not part of the course's core).

peers   each system the bench compares (kvlearn's cache modes, Hugging Face, vLLM) as a SystemResult
report  token comparison (with float ties), the course's bars, table, plot and JSON
cli     `python -m kvlearn bench`
demo    `python -m kvlearn demo`, the main job
decode  chapter 5's decode throughput against batch size
radix   chapter 3's radix tree at scale
timing  speed claims in the notebooks: printed, and said to be disturbed when a run does not show them
"""
