"""Who runs next: the scheduler, the queue order, fair shares between client requests, the
preemption cure, and the queue-wait metrics."""
