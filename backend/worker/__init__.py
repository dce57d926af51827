"""The model runner: step arrays, the forward, decode graphs, sampling."""
