//go:build tools

// Package tools pins the Kueue command this module builds (its manager), so `go mod tidy`
// keeps its dependencies.
package tools

import _ "sigs.k8s.io/kueue/cmd/kueue"
