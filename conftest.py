def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running GPU test (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "sanitize: run by `make sanitize` under compute-sanitizer")
