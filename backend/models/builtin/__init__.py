"""The built-in models: the tiny demo and SmolLM2, built or converted once."""
