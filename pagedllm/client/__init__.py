"""Engine clients: the core in this process (InprocClient) or in its own (MPClient over ZMQ),
and the data-parallel router over several cores."""
