// helm-render is built in GOPATH mode (GO111MODULE=off) against Debian's
// golang-*-dev packages, offline; see build.sh. This file is still needed: it
// makes the go command resolve "…/sprig/v3"-style imports to Debian's
// /usr/share/gocode/src/…/sprig ("minimal module compatibility").
module helm-render

go 1.19
