// Command spdy-vectors records the bytes a moby/spdystream client writes when it opens
// streams the way kube-apiserver (k8s.io/apimachinery/pkg/util/httpstream/spdy) does for
// port-forward and exec. The Rust SPDY server replays them in its tests.
//
//	go run . -out ../../src/kubelet_api/spdy/testdata/go_client.bin
//
// With -connect it instead talks to a live server (the ignored Rust test
// `go_client_against_live_server` starts one) and checks the echo it expects.
//
//	go run . -connect 127.0.0.1:PORT
package main

import (
	"bytes"
	"flag"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/moby/spdystream"
)

// recordingConn keeps a copy of every byte the client writes, in wire order.
type recordingConn struct {
	net.Conn
	mu  sync.Mutex
	buf bytes.Buffer
}

func (c *recordingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	c.buf.Write(p)
	c.mu.Unlock()
	return c.Conn.Write(p)
}

func main() {
	out := flag.String("out", "go_client.bin", "file the client's bytes are written to")
	connect := flag.String("connect", "", "address of a live server to check against instead")
	flag.Parse()
	if *connect != "" {
		checkLive(*connect)
		return
	}

	clientEnd, serverEnd := net.Pipe()
	rec := &recordingConn{Conn: clientEnd}

	server, err := spdystream.NewConnection(serverEnd, true)
	if err != nil {
		log.Fatal(err)
	}
	// net.Pipe is synchronous, so the server must drain every stream or the client blocks.
	go server.Serve(func(s *spdystream.Stream) {
		if err := s.SendReply(http.Header{}, false); err != nil {
			log.Print(err)
		}
		go func() { _, _ = io.Copy(io.Discard, s) }()
	})

	client, err := spdystream.NewConnection(rec, false)
	if err != nil {
		log.Fatal(err)
	}
	go client.Serve(spdystream.NoOpStreamHandler)

	open := func(kv ...string) *spdystream.Stream {
		h := http.Header{}
		for i := 0; i < len(kv); i += 2 {
			h.Set(kv[i], kv[i+1])
		}
		s, err := client.CreateStream(h, nil, false)
		if err != nil {
			log.Fatal(err)
		}
		if err := s.WaitTimeout(5 * time.Second); err != nil {
			log.Fatal(err)
		}
		return s
	}

	// Port-forward: the error stream first, half-closed at once, then the data stream.
	errStream := open("streamtype", "error", "port", "8080", "requestid", "0")
	if err := errStream.Close(); err != nil {
		log.Fatal(err)
	}
	data := open("streamtype", "data", "port", "8080", "requestid", "0")
	// Exec: one stream per standard stream.
	stdout := open("streamtype", "stdout")

	if _, err := data.Write([]byte("GET / HTTP/1.1\r\n\r\n")); err != nil {
		log.Fatal(err)
	}
	// One DATA frame larger than the 32 KiB the server itself writes.
	big := make([]byte, 40000)
	for i := range big {
		big[i] = byte(i % 251)
	}
	if _, err := data.Write(big); err != nil {
		log.Fatal(err)
	}
	if _, err := client.Ping(); err != nil {
		log.Fatal(err)
	}
	if err := data.Close(); err != nil {
		log.Fatal(err)
	}
	if err := stdout.Reset(); err != nil {
		log.Fatal(err)
	}
	if err := client.Close(); err != nil {
		log.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)

	rec.mu.Lock()
	defer rec.mu.Unlock()
	if err := os.WriteFile(*out, rec.buf.Bytes(), 0o644); err != nil {
		log.Fatal(err)
	}
	log.Printf("wrote %d bytes to %s", rec.buf.Len(), *out)
}

// checkLive opens port-forward streams like kube-apiserver and expects the server to echo
// "echo: " + what was sent on the data stream, and to finish the error stream empty.
func checkLive(addr string) {
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	client, err := spdystream.NewConnection(conn, false)
	if err != nil {
		log.Fatal(err)
	}
	go client.Serve(spdystream.NoOpStreamHandler)
	open := func(kv ...string) *spdystream.Stream {
		h := http.Header{}
		for i := 0; i < len(kv); i += 2 {
			h.Set(kv[i], kv[i+1])
		}
		s, err := client.CreateStream(h, nil, false)
		if err != nil {
			log.Fatal(err)
		}
		if err := s.WaitTimeout(5 * time.Second); err != nil {
			log.Fatalf("no SYN_REPLY: %v", err)
		}
		return s
	}
	errStream := open("streamtype", "error", "port", "8080", "requestid", "0")
	if err := errStream.Close(); err != nil {
		log.Fatal(err)
	}
	data := open("streamtype", "data", "port", "8080", "requestid", "0")
	payload := bytes.Repeat([]byte("0123456789"), 10000)
	if _, err := data.Write(payload); err != nil {
		log.Fatal(err)
	}
	if err := data.Close(); err != nil {
		log.Fatal(err)
	}
	if _, err := client.Ping(); err != nil {
		log.Fatalf("ping: %v", err)
	}
	got, err := io.ReadAll(data)
	if err != nil {
		log.Fatal(err)
	}
	if want := append([]byte("echo: "), payload...); !bytes.Equal(got, want) {
		log.Fatalf("data stream: got %d bytes, want %d", len(got), len(want))
	}
	errBytes, err := io.ReadAll(errStream)
	if err != nil || len(errBytes) != 0 {
		log.Fatalf("error stream: %q, %v", errBytes, err)
	}
	if err := client.Close(); err != nil {
		log.Fatal(err)
	}
	log.Print("live server OK")
}
