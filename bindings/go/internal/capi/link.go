// Package capi is libpipe's C ABI (pipe.h) as SWIG generates it for Go, plus a few DLPack
// helpers. It is internal: use package pipe, which turns status codes into errors, owns every
// handle and keeps cgo's pointer rules.
//
// The SWIG run is done by `go build` itself from capi.swig; this file only tells cgo where
// libpipe is. pkg-config's -I flags are also what swig uses to find pipe/pipe.h.
package capi

// #cgo pkg-config: libpipe
import "C"
