// The sandbox ("pause") program of the harness's real node: built locally, so nothing is
// pulled from a registry.
module tensile.dev/k8s-build/pause

go 1.26.0
