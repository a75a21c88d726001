"""The models the engine runs: the lean Llama-family forward (llama.py: prefill's forward, decode's step),
the transformers runner for other architectures (hf_runner.py), reading weights from a folder or a GGUF file
and caching what a first start converts (loader.py, folder_model.py, gguf_file.py), int8 weights
(quantize.py), and each model's own sampling defaults (model_defaults.py)."""
