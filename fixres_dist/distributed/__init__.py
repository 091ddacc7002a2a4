"""Where a rank sits and how the ranks meet and stay together: placement (rank precedence), the
rendezvous store and lost peers, the collectives, network interfaces, the job folder's lock, and
the all-rank agreement to stop (preemption), and the residual blocks that sharding and model
parallelism act on."""
