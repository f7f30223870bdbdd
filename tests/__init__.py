"""sbpflow's tests; a package so spawned ranks can import jobs as ``tests.dist.<module>``."""
