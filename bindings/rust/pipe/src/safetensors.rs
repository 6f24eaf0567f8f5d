//! safetensors files through libpipe's reader and writer (pipe_safetensors_read/write).
//!
//! libpipe can only write lists it made (a call's outputs, a file it read): pipe.h has no way to
//! build a list from caller tensors, so [`write()`] takes a [`TensorList`].

use std::path::Path;

use crate::{Result, Tensor, TensorList};

/// Every tensor of the file, copied, in file order.
pub fn read(path: impl AsRef<Path>) -> Result<Vec<(String, Tensor)>> {
    TensorList::read_safetensors(path)?.to_tensors()
}

/// The file's tensors without a copy, in a libpipe-owned list.
pub fn read_list(path: impl AsRef<Path>) -> Result<TensorList> {
    TensorList::read_safetensors(path)
}

/// Write every tensor of `list` (e.g. [`crate::Session::run_list`]'s outputs).
pub fn write(list: &TensorList, path: impl AsRef<Path>) -> Result<()> {
    list.write_safetensors(path)
}
