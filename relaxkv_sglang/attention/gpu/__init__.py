"""The GPU path: segments over pool slots (plain torch) and their FlashInfer execution; FlashInfer
is imported only when a kernel is built."""
