"""The reliability suite: crash, outage, network, storm, cluster, fuzz, isolation and memory
scenarios. ``bench/reliability.py`` runs it at full scale and renders its figures."""
