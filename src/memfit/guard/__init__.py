"""The guard: survive an OOM in training by splitting the batch, with the same update."""
