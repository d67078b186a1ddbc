#!/usr/bin/env bash
# Build helm-render offline against Debian's Go packages (see README.md):
#   bash tools/helm-render/build.sh OUTPUT_BINARY
# GOPATH mode: the sources are copied under a throwaway GOPATH (next to Debian's
# /usr/share/gocode), which is what lets "github.com/Masterminds/sprig/v3" resolve
# to Debian's unversioned directory. No network, no go.sum, no vendoring.
set -euo pipefail
out=$(realpath -m "${1:?usage: build.sh OUTPUT_BINARY}")
src=$(cd "$(dirname "$0")" && pwd)
gopath=$(mktemp -d)
trap 'rm -rf "$gopath"' EXIT
mkdir -p "$gopath/src/helm-render"
cp "$src"/*.go "$src"/go.mod "$gopath/src/helm-render/"
cd "$gopath/src/helm-render"
export GO111MODULE=off GOFLAGS= CGO_ENABLED=0 GOTOOLCHAIN=local
export GOPATH="$gopath:${HELM_RENDER_GOCODE:-/usr/share/gocode}"
export GOCACHE="${GOCACHE:-${XDG_CACHE_HOME:-${HOME:-$gopath}/.cache}/go-build}"
go build -trimpath -o "$out" .
