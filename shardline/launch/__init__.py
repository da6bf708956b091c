"""A training in several processes or on several machines, on torch's elastic agent: the job, one agent per
machine, the nodes a Prefect pool runs as flow runs, and what the training came to from torch's error records."""
