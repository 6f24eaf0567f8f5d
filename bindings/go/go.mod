module github.com/libpipe/libpipe/bindings/go

go 1.24
