// Command pause is the sandbox container's process: it holds the pod's namespaces open,
// reaps the zombies that end up with it as PID 1, and exits on SIGINT or SIGTERM, like
// Kubernetes' own pause.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range signals {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
