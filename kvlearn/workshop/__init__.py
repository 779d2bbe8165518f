"""Tool: the workshop kit (not part of the course's core).

envcheck  `python -m kvlearn check`: is this laptop ready? one OK / FAIL line per requirement
course    `python -m kvlearn course`: every notebook in a fresh kernel, in order, with a summary
student   `python -m kvlearn student`: the learners' copies, every solution replaced by a stub
mutants   `python -m kvlearn mutants`: mutants of the worked solutions, each one killed by its part's check or listed
mutant_review  what a part answers on its suite's programs: an equivalent mutant answers as the solution does
"""
