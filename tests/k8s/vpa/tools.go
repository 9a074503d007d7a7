//go:build tools

// Package tools pins the VerticalPodAutoscaler command this module builds (its updater), so
// `go mod tidy` keeps its dependencies.
package tools

import _ "k8s.io/autoscaler/vertical-pod-autoscaler/pkg/updater"
