"""A model of a phone prefill (`llmnpu simulate`): device profiles, a cost model from the FX graph,
the real partition and scheduler on simulated time, validation against the paper."""
