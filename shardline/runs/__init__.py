"""One training run around `fit`: its identity and folder in the storage root, the fine-tune parent, its MLflow run,
its live view in the Prefect UI, its cost ledger, and the links between its Prefect runs and its MLflow run and
version. Below the tasks (which call it), above the launching of several processes and the trainer."""
