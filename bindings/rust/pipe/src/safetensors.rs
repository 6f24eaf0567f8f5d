//! safetensors files through libpipe's reader and writer (pipe_safetensors_read/write).

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

/// Write every tensor of `list` (e.g. [`crate::Session::run_list`]'s outputs, or a list built
/// with [`TensorList::append`]).
pub fn write(list: &TensorList, path: impl AsRef<Path>) -> Result<()> {
    list.write_safetensors(path)
}

/// Write the caller's tensors, in order (e.g. what [`read`] or [`crate::Session::run`]
/// returned): they are copied into a libpipe list ([`TensorList::from_tensors`]) which libpipe's
/// writer writes. [`crate::Status::InvalidArgument`] for an empty or repeated name, and nothing
/// is written then.
pub fn write_tensors<S: AsRef<str>>(tensors: &[(S, Tensor)], path: impl AsRef<Path>) -> Result<()> {
    TensorList::from_tensors(tensors)?.write_safetensors(path)
}
