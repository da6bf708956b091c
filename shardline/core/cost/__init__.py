"""What training costs: prices and hours (`prices`), and each run's ledger of attempts (`ledger`)."""
