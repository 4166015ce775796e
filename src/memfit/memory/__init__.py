"""Memory accounting: the storage tracker, the CUDA allocator model, the devices."""
