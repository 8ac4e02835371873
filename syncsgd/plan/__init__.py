"""The planner: per-layer costs, the paper's balance equations and a cluster model, which say how
a net should be spread over N nodes and what speedup to expect (the paper (Das et al., 2016), section 4)."""
