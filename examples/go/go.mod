module github.com/libpipe/libpipe/examples/go

go 1.24

require github.com/libpipe/libpipe/bindings/go v0.0.0

replace github.com/libpipe/libpipe/bindings/go => ../../bindings/go
