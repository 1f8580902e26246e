"""The cluster client: the nodes, the links to them, the requests in flight, routing, the queue
delay and admission refusals; it knows nothing of HTTP or OpenAI shapes."""
