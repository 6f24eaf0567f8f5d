//! Lists built from the caller's tensors (TensorList::new / append, pipe_tensor_list_create /
//! pipe_tensor_list_append) and written with libpipe's safetensors writer.
mod common;

use std::os::raw::c_void;
use std::ptr;

use common::*;
use pipe::{sys, DType, Status, Tensor, TensorList, TensorRef};

/// One tensor of every dtype, with a scalar and an empty one.
fn all_dtypes() -> Vec<(String, Tensor)> {
    vec![
        ("f32".into(), Tensor::new(vec![2, 3], vec![1f32, 2., 3., 4., 5., 6.]).unwrap()),
        ("f64".into(), Tensor::new(vec![2, 1], vec![-1.5f64, std::f64::consts::PI]).unwrap()),
        ("f16".into(), Tensor::from_bits(DType::F16, vec![2], vec![0x3c00, 0xc000]).unwrap()),
        ("bf16".into(), Tensor::from_bits(DType::BF16, vec![1, 2], vec![0x3fc0, 0xc040]).unwrap()),
        ("i64".into(), Tensor::scalar(-7i64)),
        ("i32".into(), Tensor::new(vec![2], vec![1i32 << 30, -3]).unwrap()),
        ("i16".into(), Tensor::new(vec![1, 2], vec![-2i16, 3]).unwrap()),
        ("i8".into(), Tensor::new(vec![2], vec![-128i8, 127]).unwrap()),
        ("u8".into(), Tensor::new(vec![2], vec![0u8, 255]).unwrap()),
        ("bool".into(), Tensor::new(vec![3], vec![true, false, true]).unwrap()),
        ("empty".into(), Tensor::new(vec![0, 4], Vec::<f32>::new()).unwrap()),
    ]
}

#[test]
fn write_tensors_round_trip() {
    let tensors = all_dtypes();
    let path = scratch("all-dtypes.safetensors");
    pipe::safetensors::write_tensors(&tensors, &path).unwrap();
    // Read back with libpipe's reader (which validates the file): same names, order, dtypes,
    // shapes and bits.
    assert_eq!(pipe::safetensors::read(&path).unwrap(), tensors);
    // &[(&str, Tensor)] works as well as String names.
    let borrowed: Vec<(&str, Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t.clone())).collect();
    pipe::safetensors::write_tensors(&borrowed, &path).unwrap();
    assert_eq!(pipe::safetensors::read(&path).unwrap(), tensors);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn append_copies_each_kind_of_tensor() {
    let mut t = Tensor::new(vec![2, 2], vec![1i32, 2, 3, 4]).unwrap();
    let mut file = pipe::safetensors::read_list(fixture("demo.inputs.safetensors")).unwrap();
    let x = file.get_by_name("x").unwrap().to_tensor().unwrap();
    let taken = file.take(file.find("x").unwrap()).unwrap();
    let other = TensorList::from_tensors(&[("y", Tensor::scalar(2.5f64))]).unwrap();

    let mut list = TensorList::new().unwrap();
    assert!(list.is_empty());
    list.append("t", &t).unwrap(); // &Tensor
    list.append("x", &taken).unwrap(); // &ManagedTensor
    list.append("y", other.get(0).unwrap()).unwrap(); // TensorRef of another list
    assert_eq!(list.names().unwrap(), vec!["t", "x", "y"]);

    // The list holds copies: changing or dropping the sources leaves it as it was.
    t.as_mut_slice::<i32>().unwrap()[0] = 100;
    drop(taken);
    drop(other);
    assert_eq!(
        list.to_tensors().unwrap(),
        vec![
            ("t".to_string(), Tensor::new(vec![2, 2], vec![1i32, 2, 3, 4]).unwrap()),
            ("x".to_string(), x),
            ("y".to_string(), Tensor::scalar(2.5f64)),
        ]
    );
    // And the caller's tensor was only read.
    assert_eq!(t.as_slice::<i32>().unwrap(), &[100, 2, 3, 4]);
}

/// A DLPack view of `data` (float32) with the given shape and strides.
fn f32_view(data: &[f32], shape: &mut [i64], strides: &mut [i64], lanes: u16) -> sys::DLManagedTensor {
    sys::DLManagedTensor {
        dl_tensor: sys::DLTensor {
            data: data.as_ptr() as *mut c_void,
            device: sys::DLDevice { device_type: sys::DLDeviceType::kDLCPU, device_id: 0 },
            ndim: shape.len() as i32,
            dtype: sys::DLDataType { code: sys::DLDataTypeCode::kDLFloat as u8, bits: 32, lanes },
            shape: shape.as_mut_ptr(),
            strides: strides.as_mut_ptr(),
            byte_offset: 0,
        },
        manager_ctx: ptr::null_mut(),
        deleter: None,
    }
}

#[test]
fn append_strided_and_unreadable_dlpack() {
    let src = [1f32, 2., 3., 4., 5., 6.]; // 2x3 row-major
    let (mut shape, mut strides) = ([3i64, 2], [1i64, 3]); // its transpose, 3x2
    let m = f32_view(&src, &mut shape, &mut strides, 1);
    let mut list = TensorList::new().unwrap();
    // SAFETY: `m` and what it points at outlive the view.
    list.append("t", unsafe { TensorRef::from_raw(&m) }).unwrap();
    // libpipe stores the logical 3x2 tensor (copied row-major), as written and read back.
    let path = scratch("strided.safetensors");
    pipe::safetensors::write(&list, &path).unwrap();
    let back = pipe::safetensors::read(&path).unwrap();
    assert_eq!(back, vec![("t".to_string(), Tensor::new(vec![3, 2], vec![1f32, 4., 2., 5., 3., 6.]).unwrap())]);
    std::fs::remove_file(&path).unwrap();

    // Vector lanes are a DLPack type LibTorch does not read: refused by the C boundary's DLPack checks,
    // PIPE_ERR_INVALID_ARGUMENT naming the entry and the field.
    let (mut shape, mut strides) = ([1i64], [1i64]);
    let odd = f32_view(&src, &mut shape, &mut strides, 4);
    let e = list.append("odd", unsafe { TensorRef::from_raw(&odd) }).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    assert!(e.message.contains("'odd'") && e.message.contains("lanes"), "{}", e.message);
    assert_eq!(list.names().unwrap(), vec!["t"], "a refused tensor is not appended");
}

#[test]
fn append_and_write_tensors_refuse_bad_names() {
    let a = Tensor::new(vec![2], vec![1f32, 2.]).unwrap();
    let b = Tensor::scalar(3i64);
    let mut list = TensorList::new().unwrap();
    list.append("a", &a).unwrap();

    let e = list.append("a", &b).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    assert!(e.message.contains("'a'"), "{}", e.message);
    let e = list.append("", &b).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    assert!(e.message.contains("empty"), "{}", e.message);
    // C would only see "b": refused before libpipe is called.
    let e = list.append("b\0c", &b).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    assert!(e.message.contains("NUL"), "{}", e.message);
    // The failed appends left the list as it was.
    assert_eq!(list.to_tensors().unwrap(), vec![("a".to_string(), a.clone())]);

    // write_tensors refuses a repeated name before writing anything.
    let path = scratch("repeated.safetensors");
    let _ = std::fs::remove_file(&path);
    let e = pipe::safetensors::write_tensors(&[("a", a.clone()), ("a", Tensor::scalar(1i64))], &path).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    assert!(!path.exists(), "nothing is written after a refused name");
    // libpipe's writer refuses the header's reserved key.
    let e = pipe::safetensors::write_tensors(&[("__metadata__", a)], &path).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    assert!(!path.exists());
}
