"""Weight formats and their kernels: dense, int8, NF4, group-wise 2/3/4-bit, the vocabulary subset head."""
