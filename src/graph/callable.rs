//! What can be graphed: every [`Module`], seen through [`Callable`], its object-safe form, so
//! that modules of different types are captured together.

use std::any::Any;

use crate::device::Stream;
use crate::nn::{GradHook, Inputs, Module, Param, SaveHook};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// What a forward saves for its backward, type-erased.
pub type Saved = Box<dyn Any + Send>;

mod sealed {
    pub trait Sealed {}
    impl<M: crate::nn::Module> Sealed for M {}
}

/// A [`Module`] with its context type erased, as `make_graphed_callables` takes it
/// (`&[&dyn Callable]`). Every module is one; implement [`Module`], never this trait. Its methods
/// carry a `_dyn` suffix so that they never shadow the module's own with both traits in scope.
///
/// ```
/// use graphed::device::Device;
/// use graphed::graph::Callable;
/// use graphed::memory::CachingAllocator;
/// use graphed::nn::{Builder, Inputs, KeepOnDevice, Linear, Module, ParamStore};
/// use graphed::tensor::Tensor;
///
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let alloc = CachingAllocator::new(&dev);
/// let store = ParamStore::new(&alloc, &s, 15)?;
/// let fc = Linear::new(&Builder::new(&store, &alloc, &s)?.with_seed(1).pp("fc"), (4, 3))?;
/// let x = Tensor::from_host(&alloc, &s, &[0.5f32; 8], &[2, 4])?;
/// let (y, _ctx) = fc.forward(&Inputs::one(&x), &KeepOnDevice, &s)?; // the module's own forward
/// let as_callable: &dyn Callable = &fc;
/// assert_eq!((y[0].shape(), as_callable.name().as_str()), (&[2, 3][..], "Linear"));
/// # Ok::<(), graphed::Error>(())
/// ```
pub trait Callable: Sync + sealed::Sealed {
    /// A name for errors and reports: the module's type name.
    fn name(&self) -> String;

    /// [`Module::forward`], its context boxed.
    fn forward_dyn(&self, inputs: &Inputs, hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor>, Saved)>;

    /// [`Module::backward_hooked`] of a boxed context.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when `saved` comes from another module's forward.
    fn backward_dyn(
        &self,
        saved: Saved,
        grad_outputs: &[&Tensor],
        hook: &dyn GradHook,
        stream: &Stream,
    ) -> Result<Vec<Option<Tensor>>>;

    /// [`Module::backward_dw`].
    fn backward_dw_dyn(&self, stream: &Stream) -> Result<()>;

    /// [`Module::splits_dw`].
    fn splits_dw_dyn(&self) -> bool;

    /// [`Module::draws_from`].
    fn draws_from_dyn(&self) -> Option<&Tensor>;

    /// [`Module::parameters`].
    fn parameters_dyn(&self) -> Vec<&Param>;

    /// [`Module::pass_state`].
    fn pass_state_dyn(&self) -> Vec<Tensor>;
}

impl<M: Module> Callable for M {
    fn name(&self) -> String {
        std::any::type_name::<M>().rsplit("::").next().unwrap_or("module").to_string()
    }

    fn forward_dyn(&self, inputs: &Inputs, hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor>, Saved)> {
        let (outputs, ctx) = self.forward(inputs, hook, stream)?;
        Ok((outputs, Box::new(ctx)))
    }

    fn backward_dyn(
        &self,
        saved: Saved,
        grad_outputs: &[&Tensor],
        hook: &dyn GradHook,
        stream: &Stream,
    ) -> Result<Vec<Option<Tensor>>> {
        let ctx = saved.downcast::<M::Ctx>().map_err(|_| Error::Unsupported {
            op: "Callable::backward_dyn",
            backend: "any",
            why: "the saved context comes from another module's forward",
        })?;
        self.backward_hooked(*ctx, grad_outputs, hook, stream)
    }

    fn backward_dw_dyn(&self, stream: &Stream) -> Result<()> {
        self.backward_dw(stream)
    }

    fn splits_dw_dyn(&self) -> bool {
        self.splits_dw()
    }

    fn draws_from_dyn(&self) -> Option<&Tensor> {
        self.draws_from()
    }

    fn parameters_dyn(&self) -> Vec<&Param> {
        self.parameters()
    }

    fn pass_state_dyn(&self) -> Vec<Tensor> {
        self.pass_state()
    }
}
