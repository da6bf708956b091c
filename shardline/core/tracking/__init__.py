"""MLflow tracking that never holds training up: the tracker (`tracker`), its local journal and sender
(`journal`), and the machine's system metrics (`system`)."""
