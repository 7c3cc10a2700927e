"""Kernels against their plain-torch references (the Triton interpreter on CPU; Gluon on sm_90)."""
