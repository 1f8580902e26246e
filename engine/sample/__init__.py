"""From logits to tokens: the sampler, penalties and logit biases, structured output's grammar
mask, and prompt logprobs."""
