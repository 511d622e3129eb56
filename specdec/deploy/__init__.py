"""Deploying ``specdec serve`` replicas: the recipes above the serving layer (load balancer, cluster manifests)."""
