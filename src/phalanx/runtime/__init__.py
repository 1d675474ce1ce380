"""Per-step runtime pieces the Session composes: data sharding and device transfer, precision,
compute options, activation recomputation, the memory cap, learning-rate scaling, progress."""
