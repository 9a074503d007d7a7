# syntax=docker/dockerfile:1
# One build of the workspace, one small image per binary: pick it with --target.
#
#   docker build --target virtual-node               -t tensile/virtual-node:0.1.0 .
#   docker build --target tensile-webhook            -t tensile/tensile-webhook:0.1.0 .
#   docker build --target tensile-descheduler        -t tensile/tensile-descheduler:0.1.0 .
#   docker build --target tensile-scheduler-extender -t tensile/tensile-scheduler-extender:0.1.0 .
#
# The binaries link glibc dynamically (ring's C and assembly need a C toolchain), so the
# runtime is distroless/cc on the same Debian release as the builder: glibc, CA
# certificates, no shell, user nonroot (65532, the runAsUser of deploy/).

FROM rust:1.89-bookworm AS build
WORKDIR /src
COPY . .
# Cache mounts keep the registry and target between builds; the binaries are copied out
# of the cached target because it is not part of the image layer.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --profile dist --locked --workspace \
      --bin virtual-node --bin tensile-descheduler \
      --bin tensile-webhook --bin tensile-scheduler-extender \
 && mkdir /out \
 && cp target/dist/virtual-node target/dist/tensile-descheduler \
       target/dist/tensile-webhook target/dist/tensile-scheduler-extender /out/

FROM gcr.io/distroless/cc-debian12:nonroot AS virtual-node
COPY --from=build /out/virtual-node /usr/local/bin/virtual-node
USER nonroot:nonroot
# The kubelet API and the metrics endpoint (--metrics-addr in deploy/virtual-node).
EXPOSE 10250 10255
ENTRYPOINT ["/usr/local/bin/virtual-node"]

FROM gcr.io/distroless/cc-debian12:nonroot AS tensile-descheduler
COPY --from=build /out/tensile-descheduler /usr/local/bin/tensile-descheduler
USER nonroot:nonroot
EXPOSE 10258
ENTRYPOINT ["/usr/local/bin/tensile-descheduler"]

FROM gcr.io/distroless/cc-debian12:nonroot AS tensile-webhook
COPY --from=build /out/tensile-webhook /usr/local/bin/tensile-webhook
USER nonroot:nonroot
EXPOSE 8443
ENTRYPOINT ["/usr/local/bin/tensile-webhook"]

FROM gcr.io/distroless/cc-debian12:nonroot AS tensile-scheduler-extender
COPY --from=build /out/tensile-scheduler-extender /usr/local/bin/tensile-scheduler-extender
USER nonroot:nonroot
EXPOSE 8888
ENTRYPOINT ["/usr/local/bin/tensile-scheduler-extender"]
