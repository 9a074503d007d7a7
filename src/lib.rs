//! tensile: joins a lower Kubernetes cluster to an upper one as a virtual node.
