"""The planner: per-layer costs, the paper's balance equations and a cluster model, which say how
a net should be spread over N nodes and what speedup to expect (PAPER.md section 4)."""
