"""Text from a trained model: `decode.py` (a KV cache over the model's own parameters: prefill
the prompt once, then one token per jitted step) and the program, `python -m olmo3.sample`."""
