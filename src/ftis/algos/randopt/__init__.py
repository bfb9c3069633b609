"""RandOpt and CoRP: gradient-free post-training where only seeds and rewards move
(`algorithm.kind: randopt` and `corp`; docs/randopt.md)."""
