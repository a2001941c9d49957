"""One module per service: its partition task (pure with respect to Kafka) and its wiring."""
