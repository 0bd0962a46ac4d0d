"""Around the core: loading it after the torch-version and build checks,
every difference between supported torch versions, the environment report,
and test-only fault injection."""
