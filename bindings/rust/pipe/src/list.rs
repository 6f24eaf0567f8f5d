use std::ffi::CStr;
use std::path::Path;
use std::ptr::{self, NonNull};

use pipe_sys as sys;

use crate::error::{check, Error, Result, Status};
use crate::tensor::{AppendSource, ManagedTensor, Tensor, TensorRef};

/// An ordered list of named tensors owned by libpipe: the outputs of a call, the contents of a
/// safetensors file, or copies of the caller's tensors ([`TensorList::new`] and
/// [`TensorList::append`]). Entries can be borrowed without a copy ([`TensorList::get`]), taken
/// out ([`TensorList::take`]) or copied ([`TensorList::to_tensors`]).
///
/// `Send` but not `Sync` (see the note on the impl):
/// ```compile_fail,E0277
/// fn sync<T: Sync>() {}
/// sync::<pipe::TensorList>();
/// ```
pub struct TensorList {
    ptr: NonNull<sys::pipe_tensor_list>,
}

// SAFETY: pipe.h marks the list's functions "thread-safe" or "exclusive"; neither ties a list to
// the thread that made it, so it may move to another thread. Not Sync: pipe_tensor_list_get is
// exclusive and takes &self here, so two threads must never hold &TensorList at once.
unsafe impl Send for TensorList {}

impl std::fmt::Debug for TensorList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries((0..self.len()).map(|i| (self.name(i).ok(), self.get(i).ok()))).finish()
    }
}

impl TensorList {
    /// Take ownership of a list libpipe returned.
    ///
    /// # Safety
    /// `list` must be a valid list the caller owns and hands over.
    pub(crate) unsafe fn from_raw(list: *mut sys::pipe_tensor_list) -> Result<TensorList> {
        NonNull::new(list)
            .map(|ptr| TensorList { ptr })
            .ok_or_else(|| Error::new(Status::Internal, "libpipe returned a NULL tensor list"))
    }

    /// A new empty list, to fill with [`TensorList::append`].
    pub fn new() -> Result<TensorList> {
        let mut list = ptr::null_mut();
        // SAFETY: global function; `list` is written only on success, and we own it then.
        check(unsafe { sys::pipe_tensor_list_create(&mut list) })?;
        unsafe { TensorList::from_raw(list) }
    }

    /// A new list holding copies of `tensors`, in order (names must be unique and non-empty).
    pub fn from_tensors<S: AsRef<str>>(tensors: &[(S, Tensor)]) -> Result<TensorList> {
        let mut list = TensorList::new()?;
        for (name, tensor) in tensors {
            list.append(name.as_ref(), tensor)?;
        }
        Ok(list)
    }

    /// Append a copy of `tensor` (a `&`[`Tensor`], a [`TensorRef`] or a `&`[`ManagedTensor`])
    /// under `name`; the caller keeps `tensor`, which libpipe reads during this call only.
    /// [`Status::InvalidArgument`] for an empty name, one already in the list, or one holding a
    /// NUL byte; [`Status::Input`] for a DLPack tensor LibTorch cannot read.
    pub fn append(&mut self, name: &str, tensor: impl AppendSource) -> Result<()> {
        let c = crate::cstring("name", name)?;
        let dl = crate::tensor::dlpack_of(&tensor);
        // SAFETY: exclusive; &mut self guarantees it. `dl` borrows `tensor`'s memory, which
        // stays valid and unchanged for the call (`tensor` is borrowed for all of it); libpipe
        // copies the elements and does not call the (absent) deleter. `c` outlives the call.
        check(unsafe { sys::pipe_tensor_list_append(self.ptr.as_ptr(), c.as_ptr(), &dl) })
    }

    /// The raw handle (still owned by this value).
    pub fn as_raw(&self) -> *mut sys::pipe_tensor_list {
        self.ptr.as_ptr()
    }

    /// Read every tensor of a safetensors file (CPU tensors, file order).
    /// [`Status::NotFound`] if it cannot be opened, [`Status::InvalidFormat`] if malformed.
    pub fn read_safetensors(path: impl AsRef<Path>) -> Result<TensorList> {
        let c = crate::path_cstring(path.as_ref())?;
        let mut list = ptr::null_mut();
        // SAFETY: global function; `c` outlives the call; `list` is written only on success.
        check(unsafe { sys::pipe_safetensors_read(c.as_ptr(), &mut list) })?;
        unsafe { TensorList::from_raw(list) }
    }

    /// Write every tensor to a safetensors file (atomically: temporary name, then rename).
    /// Fails if an entry was taken.
    pub fn write_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        let c = crate::path_cstring(path.as_ref())?;
        // SAFETY: thread-safe on the list; `c` outlives the call.
        check(unsafe { sys::pipe_safetensors_write(self.ptr.as_ptr(), c.as_ptr()) })
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        let mut n = 0usize;
        // SAFETY: thread-safe; cannot fail for a valid list (n stays 0 if it did).
        let _ = unsafe { sys::pipe_tensor_list_size(self.ptr.as_ptr(), &mut n) };
        n
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Name of entry `index` ("output", "output.0", a safetensors key, ...).
    pub fn name(&self, index: usize) -> Result<&str> {
        let mut name = ptr::null();
        // SAFETY: thread-safe; the name lives until the list is destroyed, which needs &mut self.
        check(unsafe { sys::pipe_tensor_list_name(self.ptr.as_ptr(), index, &mut name) })?;
        let s = unsafe { CStr::from_ptr(name) };
        s.to_str().map_err(|_| Error::new(Status::InvalidFormat, format!("entry {index}'s name is not UTF-8")))
    }

    /// The entries' names in order.
    pub fn names(&self) -> Result<Vec<String>> {
        (0..self.len()).map(|i| self.name(i).map(str::to_owned)).collect()
    }

    /// Index of the entry called `name`; [`Status::NotFound`] if there is none.
    pub fn find(&self, name: &str) -> Result<usize> {
        let c = crate::cstring("name", name)?;
        let mut index = 0usize;
        // SAFETY: thread-safe; `c` outlives the call.
        check(unsafe { sys::pipe_tensor_list_find(self.ptr.as_ptr(), c.as_ptr(), &mut index) })?;
        Ok(index)
    }

    /// Borrow entry `index` without a copy; fails for an entry already taken.
    pub fn get(&self, index: usize) -> Result<TensorRef<'_>> {
        let mut t = ptr::null();
        // SAFETY: exclusive per list; TensorList is not Sync, so no other thread calls into it
        // meanwhile. The tensor stays valid until it is taken (take needs &mut self, so not
        // while this borrow lives) or the list is destroyed (drop, likewise).
        check(unsafe { sys::pipe_tensor_list_get(self.ptr.as_ptr(), index, &mut t) })?;
        if t.is_null() {
            return Err(Error::new(Status::Internal, "libpipe returned a NULL tensor"));
        }
        Ok(unsafe { TensorRef::from_raw(t) })
    }

    /// Borrow the entry called `name`.
    pub fn get_by_name(&self, name: &str) -> Result<TensorRef<'_>> {
        self.get(self.find(name)?)
    }

    /// Take entry `index` out of the list (it keeps its name but holds no tensor afterwards).
    pub fn take(&mut self, index: usize) -> Result<ManagedTensor> {
        let mut t = ptr::null_mut();
        // SAFETY: exclusive; &mut self guarantees it. We own the returned tensor.
        check(unsafe { sys::pipe_tensor_list_take(self.ptr.as_ptr(), index, &mut t) })?;
        unsafe { ManagedTensor::from_raw(t) }
            .ok_or_else(|| Error::new(Status::Internal, "libpipe returned a NULL tensor"))
    }

    /// Copy every entry into (name, [`Tensor`]) pairs, in order.
    pub fn to_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        (0..self.len()).map(|i| Ok((self.name(i)?.to_owned(), self.get(i)?.to_tensor()?))).collect()
    }
}

impl Drop for TensorList {
    fn drop(&mut self) {
        // SAFETY: exclusive (we own it); frees every tensor still in it.
        unsafe { sys::pipe_tensor_list_destroy(self.ptr.as_ptr()) }
    }
}
