module tensile/tests/spdy-vectors

go 1.22

require github.com/moby/spdystream v0.5.1
