"""What test modules share: the tiny models' constants and builders, oracles, fixtures of one area,
paths. No test module imports another test module (tests/project/test_test_layout.py checks);
what two test modules both need lives here."""
