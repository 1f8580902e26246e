"""The text layer: tokenizer, chat template and incremental detokenizer, without torch.

Both the router (which tokenizes and detokenizes for every request) and the engine's offline
`LLM` use it; it reads the model folder's tokenizer files with the `tokenizers` library.
"""
