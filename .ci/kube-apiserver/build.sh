#!/usr/bin/env bash
# Builds the real kube-apiserver, v1.37.2, for the tests that follow
# EndpointSlices through it (kubernetes_apiserver_test.go): no Debian package
# carries it. It builds from the Go module proxy, k8s.io/kubernetes with its
# staging modules pinned to their v0.37.2 releases (go.mod's replace block),
# once per machine, into a cache outside the clone:
# ${KUBE_APISERVER_CACHE:-$HOME/.cache/kube-apiserver}/v1.37.2/kube-apiserver.
# It prints the binary's path. The first build takes about 8 minutes on 2
# cores, plus the downloads; later calls return at once.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${KUBE_APISERVER_CACHE:-$HOME/.cache/kube-apiserver}/v1.37.2
bin=$out/kube-apiserver
if [ -x "$bin" ]; then
	echo "$bin"
	exit 0
fi
mkdir -p "$out"
# Built in a copy, so that nothing is written into the clone.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$here/go.mod" "$here/go.sum" "$here/deps.go" "$work/"
chmod u+w "$work"/*
(cd "$work" && go build -trimpath -ldflags '-s -w' -o "$bin.tmp" k8s.io/kubernetes/cmd/kube-apiserver) >&2
mv "$bin.tmp" "$bin"
echo "$bin"
