"""Weight formats and their kernels: dense, int8, NF4, the vocabulary subset head."""
