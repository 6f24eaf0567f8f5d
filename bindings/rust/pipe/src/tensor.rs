//! Tensors: [`Tensor`] (owned by Rust, typed, row-major), [`TensorRef`] (a borrowed DLPack
//! tensor) and [`ManagedTensor`] (an owned DLPack tensor whose deleter runs on drop).

use std::marker::PhantomData;
use std::mem::size_of;
use std::os::raw::c_void;
use std::ptr::{self, NonNull};

use pipe_sys as sys;

use crate::error::{Error, Result, Status};

/// DLPack's type code for booleans (kDLBool, DLPack >= 0.8). pipe.h builds on DLPack 0.6, which
/// has no name for it, but LibTorch reads and writes torch.bool with this code.
const DL_BOOL: u8 = 6;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    F32,
    F64,
    /// IEEE half precision; Rust has no such type, the data is kept as raw `u16` bits.
    F16,
    /// bfloat16, kept as raw `u16` bits.
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// PyTorch's name for it ("float32", "int64", ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I64 => "int64",
            DType::I32 => "int32",
            DType::I16 => "int16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::Bool => "bool",
        }
    }

    /// The DLPack data type.
    pub fn to_dlpack(self) -> sys::DLDataType {
        use sys::DLDataTypeCode::*;
        let (code, bits) = match self {
            DType::F32 => (kDLFloat as u8, 32),
            DType::F64 => (kDLFloat as u8, 64),
            DType::F16 => (kDLFloat as u8, 16),
            DType::BF16 => (kDLBfloat as u8, 16),
            DType::I64 => (kDLInt as u8, 64),
            DType::I32 => (kDLInt as u8, 32),
            DType::I16 => (kDLInt as u8, 16),
            DType::I8 => (kDLInt as u8, 8),
            DType::U8 => (kDLUInt as u8, 8),
            DType::Bool => (DL_BOOL, 8),
        };
        sys::DLDataType { code, bits, lanes: 1 }
    }

    /// The dtype for a DLPack data type, `None` for one this crate does not hold (vectors with
    /// lanes > 1, complex numbers, unsigned integers wider than 8 bits, ...).
    pub fn from_dlpack(dt: sys::DLDataType) -> Option<DType> {
        use sys::DLDataTypeCode::*;
        if dt.lanes != 1 {
            return None;
        }
        let code = dt.code as sys::DLDataTypeCode::Type;
        Some(match (code, dt.bits) {
            (c, 32) if c == kDLFloat => DType::F32,
            (c, 64) if c == kDLFloat => DType::F64,
            (c, 16) if c == kDLFloat => DType::F16,
            (c, 16) if c == kDLBfloat => DType::BF16,
            (c, 64) if c == kDLInt => DType::I64,
            (c, 32) if c == kDLInt => DType::I32,
            (c, 16) if c == kDLInt => DType::I16,
            (c, 8) if c == kDLInt => DType::I8,
            (c, 8) if c == kDLUInt => DType::U8,
            (c, 8) if c == DL_BOOL as sys::DLDataTypeCode::Type => DType::Bool,
            _ => return None,
        })
    }
}

mod storage {
    /// The typed buffer behind a [`super::Tensor`]. Typed vectors (not bytes) keep every
    /// element aligned for its type, which DLPack consumers may rely on.
    #[derive(Clone, Debug, PartialEq)]
    pub enum Data {
        F32(Vec<f32>),
        F64(Vec<f64>),
        F16(Vec<u16>),
        BF16(Vec<u16>),
        I64(Vec<i64>),
        I32(Vec<i32>),
        I16(Vec<i16>),
        I8(Vec<i8>),
        U8(Vec<u8>),
        Bool(Vec<bool>),
    }

    /// Keeps [`super::Element`] implemented only here.
    pub trait Sealed: Sized {
        /// Every bit pattern of the type's size is a valid value (false only for bool), so a
        /// slice of foreign memory may be viewed as `[Self]`.
        const ANY_BIT_PATTERN: bool;
        fn wrap(v: Vec<Self>) -> Data;
        fn view(d: &Data) -> Option<&[Self]>;
        fn view_mut(d: &mut Data) -> Option<&mut [Self]>;
        fn unwrap(d: Data) -> Result<Vec<Self>, Data>;
    }
}
use storage::Data;

/// A Rust type that is the element type of a tensor: f32, f64, i64, i32, i16, i8, u8, bool.
pub trait Element: storage::Sealed + Copy + Send + Sync + 'static {
    const DTYPE: DType;
}

macro_rules! element {
    ($t:ty, $variant:ident, $any:expr) => {
        impl storage::Sealed for $t {
            const ANY_BIT_PATTERN: bool = $any;
            fn wrap(v: Vec<Self>) -> Data {
                Data::$variant(v)
            }
            fn view(d: &Data) -> Option<&[Self]> {
                match d {
                    Data::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn view_mut(d: &mut Data) -> Option<&mut [Self]> {
                match d {
                    Data::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn unwrap(d: Data) -> std::result::Result<Vec<Self>, Data> {
                match d {
                    Data::$variant(v) => Ok(v),
                    other => Err(other),
                }
            }
        }
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
        }
    };
}
element!(f32, F32, true);
element!(f64, F64, true);
element!(i64, I64, true);
element!(i32, I32, true);
element!(i16, I16, true);
element!(i8, I8, true);
element!(u8, U8, true);
element!(bool, Bool, false);

macro_rules! with_data {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            Data::F32($v) => $body,
            Data::F64($v) => $body,
            Data::F16($v) => $body,
            Data::BF16($v) => $body,
            Data::I64($v) => $body,
            Data::I32($v) => $body,
            Data::I16($v) => $body,
            Data::I8($v) => $body,
            Data::U8($v) => $body,
            Data::Bool($v) => $body,
        }
    };
}

/// A dense, row-major tensor on the CPU, owned by Rust.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<i64>,
    data: Data,
}

/// Number of elements of `shape`, or why it is not a valid shape.
fn numel_of(shape: &[i64]) -> Result<usize> {
    let mut n: usize = 1;
    for &d in shape {
        let d = usize::try_from(d)
            .map_err(|_| Error::new(Status::InvalidArgument, format!("shape {shape:?} has a negative dimension")))?;
        n = n
            .checked_mul(d)
            .ok_or_else(|| Error::new(Status::InvalidArgument, format!("shape {shape:?} overflows")))?;
    }
    Ok(n)
}

impl Tensor {
    fn with_data(shape: Vec<i64>, data: Data, len: usize) -> Result<Tensor> {
        let n = numel_of(&shape)?;
        if n != len {
            return Err(Error::new(
                Status::InvalidArgument,
                format!("shape {shape:?} holds {n} elements but {len} were given"),
            ));
        }
        if i32::try_from(shape.len()).is_err() {
            return Err(Error::new(Status::InvalidArgument, "too many dimensions"));
        }
        Ok(Tensor { shape, data })
    }

    /// A tensor of `shape` holding `data` in row-major order; fails if the sizes disagree.
    pub fn new<T: Element>(shape: impl Into<Vec<i64>>, data: Vec<T>) -> Result<Tensor> {
        let len = data.len();
        Tensor::with_data(shape.into(), T::wrap(data), len)
    }

    /// As [`Tensor::new`], copying `data`.
    pub fn from_slice<T: Element>(shape: impl Into<Vec<i64>>, data: &[T]) -> Result<Tensor> {
        Tensor::new(shape, data.to_vec())
    }

    /// A 0-d tensor.
    pub fn scalar<T: Element>(value: T) -> Tensor {
        Tensor { shape: Vec::new(), data: T::wrap(vec![value]) }
    }

    /// A float16 or bfloat16 tensor from raw 16-bit patterns.
    pub fn from_bits(dtype: DType, shape: impl Into<Vec<i64>>, bits: Vec<u16>) -> Result<Tensor> {
        let len = bits.len();
        let data = match dtype {
            DType::F16 => Data::F16(bits),
            DType::BF16 => Data::BF16(bits),
            other => {
                return Err(Error::new(
                    Status::InvalidArgument,
                    format!("from_bits makes float16 or bfloat16 tensors, not {}", other.name()),
                ))
            }
        };
        Tensor::with_data(shape.into(), data, len)
    }

    pub fn dtype(&self) -> DType {
        match self.data {
            Data::F32(_) => DType::F32,
            Data::F64(_) => DType::F64,
            Data::F16(_) => DType::F16,
            Data::BF16(_) => DType::BF16,
            Data::I64(_) => DType::I64,
            Data::I32(_) => DType::I32,
            Data::I16(_) => DType::I16,
            Data::I8(_) => DType::I8,
            Data::U8(_) => DType::U8,
            Data::Bool(_) => DType::Bool,
        }
    }

    pub fn shape(&self) -> &[i64] {
        &self.shape
    }

    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    pub fn numel(&self) -> usize {
        with_data!(&self.data, v => v.len())
    }

    /// The elements, if the tensor holds `T`.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        T::view(&self.data)
    }

    /// The elements, mutable, if the tensor holds `T`.
    pub fn as_mut_slice<T: Element>(&mut self) -> Option<&mut [T]> {
        T::view_mut(&mut self.data)
    }

    /// The elements as a vector, or the tensor back if it does not hold `T`.
    pub fn into_vec<T: Element>(self) -> std::result::Result<Vec<T>, Tensor> {
        let shape = self.shape;
        T::unwrap(self.data).map_err(|data| Tensor { shape, data })
    }

    /// The raw bits of a float16 or bfloat16 tensor.
    pub fn bits(&self) -> Option<&[u16]> {
        match &self.data {
            Data::F16(v) | Data::BF16(v) => Some(v),
            _ => None,
        }
    }

    /// Every element widened to f64 (float16/bfloat16 decoded, bool as 0/1): handy for
    /// comparing results whatever their dtype.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            Data::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::F64(v) => v.clone(),
            Data::F16(v) => v.iter().map(|&b| f16_to_f32(b) as f64).collect(),
            Data::BF16(v) => v.iter().map(|&b| f32::from_bits((b as u32) << 16) as f64).collect(),
            Data::I64(v) => v.iter().map(|&x| x as f64).collect(),
            Data::I32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::I16(v) => v.iter().map(|&x| x as f64).collect(),
            Data::I8(v) => v.iter().map(|&x| x as f64).collect(),
            Data::U8(v) => v.iter().map(|&x| x as f64).collect(),
            Data::Bool(v) => v.iter().map(|&x| if x { 1.0 } else { 0.0 }).collect(),
        }
    }

    /// Copy a DLPack tensor (CPU memory, any strides) into a new `Tensor`.
    ///
    /// # Safety
    /// `tensor` must point to a valid DLManagedTensor whose shape, strides and data stay valid
    /// and unchanged for the duration of this call.
    pub unsafe fn from_dlpack(tensor: *const sys::DLManagedTensor) -> Result<Tensor> {
        if tensor.is_null() {
            return Err(Error::new(Status::InvalidArgument, "DLPack tensor is NULL"));
        }
        TensorRef::from_raw(tensor).to_tensor()
    }

    /// A DLPack description of this tensor that borrows its memory: valid while `self` is
    /// borrowed and unchanged. No deleter: the receiver must not free it (libpipe's inputs are
    /// borrowed, never freed).
    pub(crate) fn dlpack_borrow(&self) -> sys::DLManagedTensor {
        let data = with_data!(&self.data, v => v.as_ptr() as *mut c_void);
        sys::DLManagedTensor {
            dl_tensor: sys::DLTensor {
                data,
                device: sys::DLDevice { device_type: sys::DLDeviceType::kDLCPU, device_id: 0 },
                // Fits: checked when the tensor was made.
                ndim: self.shape.len() as i32,
                dtype: self.dtype().to_dlpack(),
                // libpipe only reads the shape (inputs are const DLManagedTensor*).
                shape: self.shape.as_ptr() as *mut i64,
                strides: ptr::null_mut(), // compact row-major
                byte_offset: 0,
            },
            manager_ctx: ptr::null_mut(),
            deleter: None,
        }
    }
}

/// A tensor that [`crate::TensorList::append`] can copy into a list: a `&`[`Tensor`], a
/// [`TensorRef`] (e.g. an entry of another list) or a `&`[`ManagedTensor`]. Sealed: it lends
/// libpipe a DLPack description of memory it must be able to vouch for.
pub trait AppendSource: sealed::DlpackBorrow {}

mod sealed {
    use pipe_sys as sys;

    pub trait DlpackBorrow {
        /// A DLPack description of the tensor that borrows its memory (valid while `self` is
        /// borrowed and unchanged) and has no deleter: the receiver must only read it.
        fn dlpack(&self) -> sys::DLManagedTensor;
    }
}

/// See [`sealed::DlpackBorrow::dlpack`].
pub(crate) fn dlpack_of(tensor: &impl AppendSource) -> sys::DLManagedTensor {
    tensor.dlpack()
}

impl sealed::DlpackBorrow for &Tensor {
    fn dlpack(&self) -> sys::DLManagedTensor {
        self.dlpack_borrow()
    }
}
impl AppendSource for &Tensor {}

impl sealed::DlpackBorrow for TensorRef<'_> {
    fn dlpack(&self) -> sys::DLManagedTensor {
        // The same DLTensor (its shape, strides and data stay the owner's, valid for the
        // borrow), in a DLManagedTensor of our own without a deleter, so libpipe can never free
        // the owner's tensor through it.
        sys::DLManagedTensor { dl_tensor: *self.t, manager_ctx: ptr::null_mut(), deleter: None }
    }
}
impl AppendSource for TensorRef<'_> {}

impl sealed::DlpackBorrow for &TensorRef<'_> {
    fn dlpack(&self) -> sys::DLManagedTensor {
        (**self).dlpack()
    }
}
impl AppendSource for &TensorRef<'_> {}

impl sealed::DlpackBorrow for &ManagedTensor {
    fn dlpack(&self) -> sys::DLManagedTensor {
        self.view().dlpack()
    }
}
impl AppendSource for &ManagedTensor {}

/// float16 bits to f32 (normal, subnormal, infinity, NaN).
fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: m * 2^-24.
            let v = m as f32 * f32::powi(2.0, -24);
            return if sign != 0 { -v } else { v };
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// A DLPack tensor borrowed from libpipe (an entry of a [`crate::TensorList`]) or from a
/// [`ManagedTensor`]; valid for `'a`.
#[derive(Clone, Copy)]
pub struct TensorRef<'a> {
    t: &'a sys::DLTensor,
}

impl std::fmt::Debug for TensorRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorRef")
            .field("dtype", &self.dtype())
            .field("shape", &self.shape())
            .field("device", &(self.t.device.device_type, self.t.device.device_id))
            .finish()
    }
}

impl<'a> TensorRef<'a> {
    /// # Safety
    /// `tensor` must be non-NULL and point to a DLManagedTensor that stays valid and unchanged
    /// (shape, strides, data) for `'a`.
    pub unsafe fn from_raw(tensor: *const sys::DLManagedTensor) -> TensorRef<'a> {
        TensorRef { t: &(*tensor).dl_tensor }
    }

    /// The DLTensor itself.
    pub fn as_raw(&self) -> *const sys::DLTensor {
        self.t
    }

    /// The dtype, `None` if this crate has no [`DType`] for it (see [`TensorRef::raw_dtype`]).
    pub fn dtype(&self) -> Option<DType> {
        DType::from_dlpack(self.t.dtype)
    }

    pub fn raw_dtype(&self) -> sys::DLDataType {
        self.t.dtype
    }

    pub fn shape(&self) -> &'a [i64] {
        let n = usize::try_from(self.t.ndim).unwrap_or(0);
        if n == 0 || self.t.shape.is_null() {
            return &[];
        }
        // SAFETY: a valid DLTensor's shape holds ndim entries, valid for 'a (from_raw's contract).
        unsafe { std::slice::from_raw_parts(self.t.shape, n) }
    }

    /// Strides in elements; `None` means compact row-major.
    pub fn strides(&self) -> Option<&'a [i64]> {
        let n = usize::try_from(self.t.ndim).unwrap_or(0);
        if self.t.strides.is_null() {
            return None;
        }
        if n == 0 {
            return Some(&[]);
        }
        // SAFETY: non-NULL strides of a valid DLTensor hold ndim entries.
        Some(unsafe { std::slice::from_raw_parts(self.t.strides, n) })
    }

    /// (DLPack device type, device id); `(1, 0)` is the CPU.
    pub fn device(&self) -> (u32, i32) {
        (self.t.device.device_type, self.t.device.device_id)
    }

    pub fn is_cpu(&self) -> bool {
        self.t.device.device_type == sys::DLDeviceType::kDLCPU
    }

    pub fn numel(&self) -> usize {
        numel_of(self.shape()).unwrap_or(0)
    }

    /// Elements lie in row-major order without gaps.
    pub fn is_contiguous(&self) -> bool {
        match self.strides() {
            None => true,
            Some(strides) => is_compact(self.shape(), strides),
        }
    }

    /// The elements without a copy, if the tensor holds `T` on the CPU, contiguous and aligned
    /// (`None` for bool: foreign memory is not guaranteed to hold only 0 and 1).
    pub fn as_slice<T: Element>(&self) -> Option<&'a [T]> {
        if !T::ANY_BIT_PATTERN || self.dtype() != Some(T::DTYPE) || !self.is_cpu() || !self.is_contiguous() {
            return None;
        }
        let n = self.numel();
        if n == 0 {
            return Some(&[]);
        }
        if self.t.data.is_null() {
            return None;
        }
        let p = (self.t.data as *const u8).wrapping_add(self.t.byte_offset as usize) as *const T;
        if !p.is_aligned() {
            return None;
        }
        // SAFETY: CPU memory of n elements of T (dtype checked, contiguous), valid for 'a by
        // from_raw's contract; any bit pattern is a valid T.
        Some(unsafe { std::slice::from_raw_parts(p, n) })
    }

    /// A copy in a new [`Tensor`] (CPU tensors only; any strides).
    pub fn to_tensor(&self) -> Result<Tensor> {
        let dt = self.t.dtype;
        let dtype = self.dtype().ok_or_else(|| {
            Error::new(
                Status::Unsupported,
                format!("DLPack dtype (code {}, bits {}, lanes {}) has no pipe::DType", dt.code, dt.bits, dt.lanes),
            )
        })?;
        if !self.is_cpu() {
            return Err(Error::new(
                Status::Unsupported,
                format!("tensor is on DLPack device {:?}; only CPU tensors can be copied", self.device()),
            ));
        }
        if self.t.ndim < 0 {
            return Err(Error::new(Status::InvalidArgument, "DLPack tensor has ndim < 0"));
        }
        let shape = self.shape().to_vec();
        let n = numel_of(&shape)?;
        if n > 0 && self.t.data.is_null() {
            return Err(Error::new(Status::InvalidArgument, "DLPack tensor has no data"));
        }
        let base = (self.t.data as *const u8).wrapping_add(self.t.byte_offset as usize);
        let strides = self.strides().filter(|s| !is_compact(&shape, s));
        // SAFETY: base points at n elements of `dtype` laid out by `strides` (from_raw's
        // contract); gather reads only those.
        let data = unsafe {
            match dtype {
                DType::F32 => Data::F32(gather(base, &shape, strides, n)),
                DType::F64 => Data::F64(gather(base, &shape, strides, n)),
                DType::F16 => Data::F16(gather(base, &shape, strides, n)),
                DType::BF16 => Data::BF16(gather(base, &shape, strides, n)),
                DType::I64 => Data::I64(gather(base, &shape, strides, n)),
                DType::I32 => Data::I32(gather(base, &shape, strides, n)),
                DType::I16 => Data::I16(gather(base, &shape, strides, n)),
                DType::I8 => Data::I8(gather(base, &shape, strides, n)),
                DType::U8 => Data::U8(gather(base, &shape, strides, n)),
                // Read bytes, never bool directly: a byte other than 0/1 is not a valid bool.
                DType::Bool => Data::Bool(gather::<u8>(base, &shape, strides, n).into_iter().map(|b| b != 0).collect()),
            }
        };
        Ok(Tensor { shape, data })
    }
}

/// Strides that describe compact row-major order (dimensions of size 1 may have any stride).
fn is_compact(shape: &[i64], strides: &[i64]) -> bool {
    let mut expected: i64 = 1;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d != 1 && s != expected {
            return false;
        }
        expected = expected.saturating_mul(d);
    }
    true
}

/// Copy `n` elements of T starting at `base`, row-major, following `strides` (in elements) if
/// given. T must be valid for any bit pattern.
unsafe fn gather<T: Copy>(base: *const u8, shape: &[i64], strides: Option<&[i64]>, n: usize) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    match strides {
        None => {
            // Byte copy: `base` need not be aligned for T.
            ptr::copy_nonoverlapping(base, out.as_mut_ptr() as *mut u8, n * size_of::<T>());
            out.set_len(n);
        }
        Some(strides) => {
            let esize = size_of::<T>() as isize;
            let mut index = vec![0i64; shape.len()];
            for _ in 0..n {
                let offset: i64 = index.iter().zip(strides).map(|(i, s)| i * s).sum();
                out.push(ptr::read_unaligned(base.offset(offset as isize * esize) as *const T));
                for d in (0..shape.len()).rev() {
                    index[d] += 1;
                    if index[d] < shape[d] {
                        break;
                    }
                    index[d] = 0;
                }
            }
        }
    }
    out
}

/// An owned DLPack tensor (taken from a [`crate::TensorList`]): its deleter runs on drop.
///
/// Neither `Send` nor `Sync`: pipe.h does not say whether a DLPack deleter may run on another
/// thread than the one that took the tensor, so it is not allowed to.
/// ```compile_fail,E0277
/// fn send<T: Send>() {}
/// send::<pipe::ManagedTensor>();
/// ```
pub struct ManagedTensor {
    ptr: NonNull<sys::DLManagedTensor>,
    _not_send: PhantomData<*mut sys::DLManagedTensor>,
}

impl std::fmt::Debug for ManagedTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ManagedTensor").field(&self.view()).finish()
    }
}

impl ManagedTensor {
    /// Take ownership of a DLManagedTensor; `None` for NULL.
    ///
    /// # Safety
    /// `tensor` must be a valid DLManagedTensor that the caller owns (its deleter is called
    /// exactly once, by this value's drop, unless [`ManagedTensor::into_raw`] gives it back).
    pub unsafe fn from_raw(tensor: *mut sys::DLManagedTensor) -> Option<ManagedTensor> {
        NonNull::new(tensor).map(|ptr| ManagedTensor { ptr, _not_send: PhantomData })
    }

    /// Give up ownership: the caller must call the deleter.
    pub fn into_raw(self) -> *mut sys::DLManagedTensor {
        let p = self.ptr.as_ptr();
        std::mem::forget(self);
        p
    }

    /// The tensor, borrowed.
    pub fn view(&self) -> TensorRef<'_> {
        // SAFETY: owned and valid until drop.
        unsafe { TensorRef::from_raw(self.ptr.as_ptr()) }
    }

    pub fn dtype(&self) -> Option<DType> {
        self.view().dtype()
    }

    pub fn shape(&self) -> &[i64] {
        self.view().shape()
    }

    /// See [`TensorRef::as_slice`].
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        self.view().as_slice()
    }

    /// A copy in a new [`Tensor`].
    pub fn to_tensor(&self) -> Result<Tensor> {
        self.view().to_tensor()
    }
}

impl Drop for ManagedTensor {
    fn drop(&mut self) {
        // SAFETY: we own the tensor; its deleter (if any) frees it exactly once.
        unsafe {
            if let Some(deleter) = (*self.ptr.as_ptr()).deleter {
                deleter(self.ptr.as_ptr());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_checks_shape_against_data() {
        assert!(Tensor::new(vec![2, 3], vec![0f32; 6]).is_ok());
        let e = Tensor::new(vec![2, 3], vec![0f32; 5]).unwrap_err();
        assert_eq!(e.status, Status::InvalidArgument);
        assert!(e.message.contains("6 elements"), "{}", e.message);
        assert!(Tensor::new(vec![-1, 3], vec![0f32; 3]).is_err());
    }

    #[test]
    fn typed_access_follows_dtype() {
        let t = Tensor::new(vec![2], vec![1i64, 2]).unwrap();
        assert_eq!(t.dtype(), DType::I64);
        assert_eq!(t.as_slice::<i64>(), Some(&[1i64, 2][..]));
        assert_eq!(t.as_slice::<f32>(), None);
        let t = t.into_vec::<f32>().unwrap_err();
        assert_eq!(t.into_vec::<i64>().unwrap(), vec![1, 2]);
    }

    // A borrowed DLPack view of a Rust tensor and a copy back through it round-trip exactly.
    #[test]
    fn dlpack_round_trip() {
        let t = Tensor::new(vec![2, 2], vec![true, false, false, true]).unwrap();
        let m = t.dlpack_borrow();
        let back = unsafe { Tensor::from_dlpack(&m) }.unwrap();
        assert_eq!(back, t);
        let t = Tensor::scalar(7i32);
        let m = t.dlpack_borrow();
        let r = unsafe { TensorRef::from_raw(&m) };
        assert_eq!(r.shape(), &[] as &[i64]);
        assert_eq!(r.as_slice::<i32>(), Some(&[7][..]));
    }

    // A transposed (strided) DLPack view is copied in row-major order of its logical shape.
    #[test]
    fn strided_copy() {
        let src = [1f32, 2., 3., 4., 5., 6.]; // 2x3 row-major
        let mut shape = [3i64, 2];
        let mut strides = [1i64, 3]; // its transpose, 3x2
        let m = sys::DLManagedTensor {
            dl_tensor: sys::DLTensor {
                data: src.as_ptr() as *mut c_void,
                device: sys::DLDevice { device_type: sys::DLDeviceType::kDLCPU, device_id: 0 },
                ndim: 2,
                dtype: DType::F32.to_dlpack(),
                shape: shape.as_mut_ptr(),
                strides: strides.as_mut_ptr(),
                byte_offset: 0,
            },
            manager_ctx: ptr::null_mut(),
            deleter: None,
        };
        let r = unsafe { TensorRef::from_raw(&m) };
        assert!(!r.is_contiguous());
        assert_eq!(r.as_slice::<f32>(), None);
        let t = r.to_tensor().unwrap();
        assert_eq!(t.shape(), &[3, 2]);
        assert_eq!(t.as_slice::<f32>().unwrap(), &[1., 4., 2., 5., 3., 6.]);
    }

    #[test]
    fn half_decoding() {
        let t = Tensor::from_bits(DType::F16, vec![4], vec![0x3c00, 0xc000, 0x0001, 0x7c00]).unwrap();
        let v = t.to_f64_vec();
        assert_eq!(v[0], 1.0);
        assert_eq!(v[1], -2.0);
        assert_eq!(v[2], 2f64.powi(-24));
        assert!(v[3].is_infinite());
        let b = Tensor::from_bits(DType::BF16, vec![1], vec![0x3fc0]).unwrap();
        assert_eq!(b.to_f64_vec(), vec![1.5]);
    }
}
