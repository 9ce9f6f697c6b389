# One image with leasebucket's commands, statically linked, run as a non-root user:
#   docker build -t leasebucket:dev .
# The Kubernetes manifests (deploy/kubernetes) name the binary to run in each container.
# deploy/deploy_test.go checks this file (stages, static build, user, binaries); docs/operations.md
# says how it is built and what is checked without a container engine.

FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# Static binaries: no cgo, so they run on an image without a C library.
ENV CGO_ENABLED=0
RUN go build -trimpath -ldflags="-s -w" -o /out/leasebucket-agent ./cmd/agent && \
    go build -trimpath -ldflags="-s -w" -o /out/leasebucket-coordinator ./cmd/coordinator && \
    go build -trimpath -ldflags="-s -w" -o /out/lbpolicy ./cmd/lbpolicy && \
    go build -trimpath -ldflags="-s -w" -o /out/lbcheck ./cmd/lbcheck

# distroless static: CA certificates, time zones and a nonroot user (65532), nothing else.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/ /usr/local/bin/
USER 65532:65532
# The metrics (7071, 7072), the coordinator's gRPC (7070), the health ports (7074).
EXPOSE 7070 7071 7072 7074
ENTRYPOINT ["/usr/local/bin/leasebucket-coordinator"]
